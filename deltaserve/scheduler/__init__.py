"""Stage package: scheduler."""
