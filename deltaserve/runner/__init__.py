"""Stage package: runner."""
