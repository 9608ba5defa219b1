"""Placeholder removed when the family lands."""
