"""Stage package: bench."""
