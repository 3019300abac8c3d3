"""Wire protocol of cascade-rl: typed messages, the msgpack codec, socket helpers.

Imports nothing else of ours (docs/ARCHITECTURE.md §1)."""

from .codec import PROTOCOL_VERSION, ProtocolError, decode, encode
from .messages import (
    Control,
    ControlReply,
    Heartbeat,
    PromptRequest,
    Ready,
    Rollout,
    SamplingParams,
    Score,
    ScoreRequest,
    StepDone,
    TeacherLogprobs,
    TeacherRequest,
    TrainBatch,
    WeightsReady,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Control",
    "ControlReply",
    "Heartbeat",
    "PromptRequest",
    "ProtocolError",
    "Ready",
    "Rollout",
    "SamplingParams",
    "Score",
    "ScoreRequest",
    "StepDone",
    "TeacherLogprobs",
    "TeacherRequest",
    "TrainBatch",
    "WeightsReady",
    "decode",
    "encode",
]
