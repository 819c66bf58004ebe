"""From a validated request to a data plane: admission queue, block budgets, the prefix index,
placement and routing over snapshots of the links, and the links themselves."""
