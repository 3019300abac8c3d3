"""Teacher servers for MOPD (docs/ARCHITECTURE.md §4): token log-probs of given sequences under a frozen checkpoint.

One process per teacher checkpoint (``teachers/server.py``), serving the domains it is the teacher of:

    python -m cascade_rl.teachers.server --config RUN_DIR/config.yaml --worker-id teacher-0 \\
        --model PATH --domains math,mcqa

The orchestrator sends each group of a MOPD batch (one prompt, its n sampled responses) to the teacher of its
domain as a ``TeacherRequest`` and gets back a ``TeacherLogprobs``: log π_teacher of every response token, at
the sampling temperature, computed with the trainer's own log-prob code (``modeling.policy.Policy``), so that
a_t = log π_teacher − log π_θ compares like with like. Requests that arrive together share one forward.
"""
