"""Cost models: pure functions from (op | collective | states, placement, cluster) to
seconds and bytes. Every formula lives in exactly one function here; the solver, the CLI
and the reports all call it."""
