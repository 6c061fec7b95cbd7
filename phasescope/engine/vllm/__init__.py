"""Everything that imports vLLM: the `Engine` over `AsyncLLM` (engine) and the stat logger (stats).

vLLM's request and scheduler statistics are documented as unstable interfaces;
keeping every reader of them here keeps an upgrade's blast radius to this
package (an import-linter contract in pyproject.toml holds the line).
"""
