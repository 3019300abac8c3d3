"""Config mistakes as one line that says what to change, not a Hydra traceback.

    try:
        compose("tiny", ["run.stepz=3"])
    except ConfigError as e:
        print(e)   # run.stepz: no such setting (did you mean run.steps?)

``explain`` reads the exception Hydra or OmegaConf raised (an unknown key, a
value of the wrong type, a preset that does not exist, an override that does
not parse); ``unknown_keys`` finds keys that ``+key=value`` added beside the
schema, which Hydra accepts silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from omegaconf import DictConfig


class ConfigError(ValueError):
    """A launch config that cannot run, with what to change: the command line prints it and exits 2."""


def _section(schema: type, name: str) -> type | None:
    """The dataclass of field ``name`` of dataclass ``schema`` (a config section), or None."""
    field = next((f for f in dataclasses.fields(schema) if f.name == name), None) if dataclasses.is_dataclass(
        schema) else None
    if field is None or field.default_factory is dataclasses.MISSING:
        return None
    value = field.default_factory()
    return type(value) if dataclasses.is_dataclass(value) else None


# keys of earlier versions -> where they live now (the sections of supervisor/schema.py): the one table of moved keys
RENAMED = {
    "workers.samplers": "sampler.count", "workers.sampler_engine": "sampler.engine",
    "workers.sampler_slots": "sampler.slots", "workers.sampler_stream_groups": "sampler.stream_groups",
    "workers.sampler_delay_s": "sampler.delay_s", "workers.sampler_launcher": "sampler.launcher",
    "workers.sampler_threads": "sampler.threads", "workers.vllm": "sampler.vllm", "workers.sglang": "sampler.sglang",
    "workers.verifiers": "verifier.count", "workers.verifier_procs": "verifier.procs",
    "workers.verifier_domains": "verifier.domains", "workers.verifier_plugins": "verifier.plugins",
    "workers.judge": "verifier.judge", "teachers": "teacher.checkpoints",
    "trainer.importance_weights": "trainer.correction (importance_weights=true is correction=icepop)",
    "workers.inflight_updates": "sampler.inflight_updates",
    **{f"trainer.{key}": f"run.{key}" for key in ("algorithm", "steps", "prompts_per_step", "group_size", "seed",
                                                   "resume_from")},
    **{f"weights_options.{key}": f"weights_options.stream.{key}" for key in ("endpoint", "host", "chunk_mb")},
    "weights_options.keep": "weights_options.TRANSPORT.keep (TRANSPORT: shm, stream, cuda_ipc or delta)",
}


def _suggest(full_key: str, schema: type) -> str:
    """" (did you mean run.steps?)" for a misspelt key of the schema, " (moved to sampler.engine)" for a key
    of an earlier version, else ""."""
    for old, new in RENAMED.items():
        if full_key == old or full_key.startswith(old + "."):
            return f" (moved to {new}{full_key[len(old):]})"
    if full_key == "workers":
        return " (its settings moved to the sections sampler, verifier and teacher)"
    *parents, leaf = full_key.split(".")
    node: type | None = schema
    for part in parents:
        node = _section(node, part)
        if node is None:
            return ""
    close = difflib.get_close_matches(leaf, [f.name for f in dataclasses.fields(node)], n=1)
    return f" (did you mean {'.'.join([*parents, close[0]])}?)" if close else ""


def renamed_overrides(overrides: list[str]) -> list[str]:
    """One line per override that sets a key of an earlier version, naming where it lives now."""
    out = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        for old, new in RENAMED.items():
            if key == old or key.startswith(old + "."):
                out.append(f"{key} moved to {new}{key[len(old):]}")
    return out


def explain(e: BaseException, schema: type) -> str:
    """One line (or a few) for a Hydra / OmegaConf error raised while composing a config."""
    chain, cause = [], e
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for c in chain:
        text = str(c)
        full_key = getattr(c, "full_key", None) or (re.search(r"full_key: (\S+)", text) or [None, None])[1]
        if type(c).__name__ in ("ConfigAttributeError", "ConfigKeyError") and full_key:
            return f"{full_key}: no such setting{_suggest(full_key, schema)}"
        if type(c).__name__ == "ValidationError" and full_key:
            hint = f" (a list: {full_key}=[a,b])" if "is not a ListConfig" in text else ""
            return f"{full_key}: {text.splitlines()[0]}{hint}"
    name = type(e).__name__
    if name == "MissingConfigException":
        found = re.search(r"Could not find '([^']+)'", str(e))
        options = re.findall(r"^\t(\S+)$", str(e), re.M)
        what = found[1].removeprefix("run/") if found else "a config"
        return f"no preset {what!r} (known: {', '.join(options)}; or a path to a YAML file)"
    if name == "OverrideParseException":
        return f"{str(e).splitlines()[0]}: overrides are KEY=VALUE (lists: KEY=[a,b]; new dict keys: +KEY=VALUE)"
    return f"{name}: {str(e).splitlines()[0] if str(e) else ''}"


def unknown_keys(cfg: DictConfig, schema: type, root: type | None = None, prefix: str = "") -> list[str]:
    """Keys of ``cfg`` that the dataclass ``schema`` does not declare (free-form dict fields excepted)."""
    root = root or schema
    names = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key in cfg:
        if key not in names:
            out.append(f"{prefix}{key}: no such setting{_suggest(f'{prefix}{key}', root)}")
        elif (section := _section(schema, key)) is not None and isinstance(cfg._get_node(key), DictConfig):
            out += unknown_keys(cfg[key], section, root, f"{prefix}{key}.")
    return out
