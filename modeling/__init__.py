"""Model code the trainer and the teachers share: loading, attention, experts, the packed log-prob path."""
