"""Recipes: the declarative format, the catalogue, overrides and OpenRecipes records."""
