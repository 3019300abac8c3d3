"""What a verifier raises when it cannot score at all, through no fault of the response.

    from cascade_rl.verifiers.errors import VerifierUnavailable
    raise VerifierUnavailable("judge at http://127.0.0.1:8000 refused the connection")

A verifier that raises anything else scores the response 0 with the reason (a malformed response is the
policy's fault, and a reward of 0 is what it earned). ``VerifierUnavailable`` is different: the judge
endpoint is down, the sandbox cannot start. A reward of 0 would then teach the policy that its response
was wrong, so the worker answers ``Score(ok=False, unavailable=True)`` and the orchestrator fails the
whole group with the reason (``verifier_unavailable: ...`` in the ledger): it is not trained on, the run
goes on (docs/ARCHITECTURE.md §6).
"""

from __future__ import annotations


class VerifierUnavailable(RuntimeError):
    """The verifier could not score (a judge endpoint down, a sandbox that cannot start): its group fails with
    this message instead of being trained on a reward of 0."""
