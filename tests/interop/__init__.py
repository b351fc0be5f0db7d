"""A package, so that the engines' fixtures (scope="package") stop after these tests, not the session."""
