"""Baselines of method.md §5 on the shared engine, one module per method (paper cited in each).

=========  ==============================================================================