"""Stage package: gates."""
