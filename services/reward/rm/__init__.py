"""slime's rule-based reward models (its --rm-type values), one module per family, same scores as slime's."""
