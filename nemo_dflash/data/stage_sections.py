"""The pipeline's data stages' recipe sections: `prompts` (the prompt files) and `regenerate` (the target's
answers). Each field is the command's flag of the same name and its default is the flag's default (the commands
read their defaults from these classes); `nemo_dflash.config.RecipeConfig` holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from nemo_dflash.data.config import WHAT, how, what


@dataclass
class PromptJobConfig:
    """One prompt file: Magpie prompts the target writes (`topics`), or a built-in source's (`source`)."""

    name: str = what(MISSING)  # the file <run>/prompts/<name>.jsonl, and its source name in regenerate.data
    weight: float = what(1.0)  # its mixing weight in regenerate (`--data NAME=FILE@WEIGHT`)
    source: Optional[str] = what(None)  # a built-in source (chitchat, gsm_symbolic:N, code, ...; no model); null: Magpie
    topics: str = what("chat=1000,code=1000,math=1000")  # Magpie: TOPIC=COUNT,...
    turns: str = what("1")  # Magpie: user turns per conversation, N or MIN-MAX
    seed: int = what(0)
    max_new_tokens: int = what(256)
    user_max_new_tokens: Optional[int] = what(None)  # Magpie: the user turns' own cap (null: max_new_tokens)
    batch_size: Any = what(64)  # a number, or auto (what the GPU's free memory holds)
    oversample: float = what(1.5)
    temperature: float = what(1.0)
    top_p: float = what(1.0)
    device: str = what("auto")
    dtype: str = what("auto")
    threads: Optional[int] = how(None)


@dataclass
class PromptsConfig:
    jobs: list[PromptJobConfig] = field(default_factory=list, metadata=WHAT)


@dataclass
class RegenerateConfig:
    """`nemo_dflash.recipes.regenerate`: the target answers the prompts; the draft trains on its answers."""

    data: list[str] = field(default_factory=list, metadata=WHAT)  # [NAME=]SOURCE[@WEIGHT]; the prompt jobs' files are added
    samples_per_prompt: int = what(1)
    decontaminate: str = what("on")  # on | off
    eval_file: list[str] = field(default_factory=list, metadata=WHAT)
    num_samples: Optional[int] = what(None)  # null: every usable conversation
    seed: int = what(0)
    turns: str = what("first")  # first | all
    max_prompt_tokens: Optional[int] = what(None)
    max_new_tokens: int = what(512)
    sampling: str = what("target")  # target | given | greedy
    temperature: float = what(0.7)
    top_p: float = what(0.95)
    engine: str = what("continuous")  # continuous: the decoding engine | generate: model.generate
    batch_size: Any = what(8)  # a number, or auto
    prepare_ahead: int = how(64)
    schedule: str = how("most_turns_first")
    loops: str = what("cut")  # cut | drop | keep
    capped: str = what("keep")
    after_cut: str = what("end")
    device: str = what("auto")
    dtype: str = what("auto")
    threads: Optional[int] = how(None)
    reasoning: Optional[str] = what(None)
    holdout: int = what(0)  # held-out prompts written beside the data, for `evaluate --datasets`
    max_bad_lines: int = how(100)
    max_minutes: Optional[float] = what(None)
    # Where the answers come from: local (the target loaded here; `engine` picks its decoder) | openai (an
    # OpenAI-compatible server serving the target; `target` then gives the tokenizer). The keys below serve
    # only openai (docs/data.md).
    backend: str = what("local")
    endpoint: Optional[str] = how(None)  # the server's OpenAI base URL, http://HOST:PORT/v1
    model: Optional[str] = what(None)  # the name the server serves the target under (null: its only model)
    api_key_env: Optional[str] = how(None)  # the NAME of the environment variable holding the key, never the key
    concurrency: int = how(32)  # requests in flight
    request_timeout: float = how(600.0)  # seconds for one answer
    retries: int = how(5)  # attempts after the first (timeouts, 429/5xx, dropped connections), with back-off
    retry_backoff: float = how(1.0)  # seconds before the first retry, doubled each retry
    server_extensions: str = what("on")  # on: top_k/min_p/penalties off and token ids asked | off: OpenAI's only
