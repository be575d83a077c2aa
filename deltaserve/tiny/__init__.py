"""Stage package: tiny."""
