"""Stage package: model."""
