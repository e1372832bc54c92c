"""The sampling defaults in force (``--sampling-defaults``): what a request that leaves a sampling field
unset gets, on every front door (ZMQ, SGLang's /generate, the OpenAI routes).

They are applied here, in the tokenizer process, which knows the model folder, when the request is
built (``RequestBuilder``): the scheduler then receives complete, typed ``SamplingParams`` and knows
nothing of where a value came from. Per field: the request's value wins, else the model's default
(``runtime.checkpoints.sampling_defaults``: its generation_config.json), else the built-in one
(``SamplingParams``' field default, OpenAI's: temperature 1.0, top_p 1.0). ``openai`` mode skips the
model's step, as SGLang's ``--sampling-defaults openai`` does.
"""

from __future__ import annotations

import logging
from typing import Any

from runtime.checkpoints.sampling_defaults import SAMPLING_DEFAULT_FIELDS, ModelSampling, read_model_sampling
from runtime.config.args import ServerArgs
from runtime.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class SamplingDefaults:
    """The mode (``model`` or ``openai``) and, in ``model`` mode, the model's recommended values."""

    def __init__(self, mode: str, model: ModelSampling | None = None) -> None:
        self.mode = mode
        self.model = model if model is not None and mode == "model" else ModelSampling()

    @classmethod
    def load(cls, server_args: ServerArgs) -> "SamplingDefaults":
        """The defaults of the served model under ``--sampling-defaults``."""
        if server_args.sampling_defaults != "model":
            return cls(server_args.sampling_defaults)
        return cls("model", read_model_sampling(server_args.resolved_model_path()))

    @property
    def values(self) -> dict[str, Any]:
        """The model's defaults in force (SamplingParams names); {} in ``openai`` mode or without any."""
        return dict(self.model.values)

    def effective(self) -> dict[str, Any]:
        """Every defaultable field's value for a request that sets none of them (model's, else built-in)."""
        built_in = SamplingParams()
        return {name: self.model.values.get(name, getattr(built_in, name)) for name in SAMPLING_DEFAULT_FIELDS}

    def info(self) -> dict[str, Any]:
        """For /get_model_info and server info: the mode, the model's values and their file, the
        values a request without sampling fields gets, and what the file had that was refused."""
        return {
            "sampling_defaults": self.mode,
            "default_sampling_params": self.values,
            "default_sampling_params_source": self.model.source,
            "effective_sampling_params": self.effective(),
            "ignored": dict(self.model.ignored),
        }

    def log(self) -> None:
        """One start-up line with the defaults in force (and a warning per value the file had that was refused)."""
        for name, why in self.model.ignored.items():
            logger.warning("ignoring the model's sampling default %s (%s): %s", name, self.model.source, why)
        effective = ", ".join(f"{k}={v:g}" for k, v in self.effective().items())
        if self.mode != "model":
            origin = "built-in (--sampling-defaults openai)"
        elif self.model.values:
            origin = f"the model's {', '.join(self.model.values)} from {self.model.source}, the rest built-in"
        else:
            origin = "built-in (the model recommends none)"
        logger.info("sampling defaults for fields a request leaves unset: %s; %s", effective, origin)
