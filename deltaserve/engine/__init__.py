"""Stage package: engine."""
