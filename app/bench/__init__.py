"""`reprise bench`: the measured claims, printed as ratios measured side by side in one run."""
