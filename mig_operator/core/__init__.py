"""Pure decisions: quantities, profile catalog, planner, slice spec validation. No I/O."""
