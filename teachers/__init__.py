"""Teacher servers for MOPD: token log-probs of given sequences under a frozen checkpoint (issue 7; empty so far)."""
