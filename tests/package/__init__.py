"""The package as shipped: its public API, README, setup script, wheel and layout rules."""
