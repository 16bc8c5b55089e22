"""Chat-data pipeline: read conversations, tokenise with the target's chat template, batch.

The data a draft trains on is made here too: prompt sources (`sources`, `prompts`), regeneration's selection
(`selection`), answers (`regenerate`, `openai_backend`), journals and rank merging (`journals`), the run's
steps (`regen_run`) and numbers (`regen_stats`), and the data report (`report`).

The names load on first use (PEP 562, `nemo_dflash.lazy_exports`): reading a config section does not import torch or the tokenizer code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_dflash import lazy_exports

if TYPE_CHECKING:
    from nemo_dflash.data.chat_template import (
        ChatFormat,
        ChatTemplateError,
        TokenizedConversation,
        detect_chat_format,
        render_with_spans,
        tokenize_conversation,
        tokenize_conversations,
    )
    from nemo_dflash.data.config import DataConfig, DataSourceConfig, as_data_config, validate_data_config
    from nemo_dflash.data.dataset import (
        ChatCollator,
        ChatDataset,
        build_dataloader,
        build_datasets,
        collate,
        pad_token_id_of,
        split_holdout,
    )
    from nemo_dflash.data.sampler import ChatBatchSampler
    from nemo_dflash.data.sources import (
        SHAREGPT_FILE,
        BadRecordCounter,
        Conversation,
        DataError,
        apply_weight,
        normalize_record,
        read_conversations,
    )

_EXPORTS = {  # module -> the names it gives this package
    "nemo_dflash.data.chat_template": (
        "ChatFormat", "ChatTemplateError", "TokenizedConversation", "detect_chat_format", "render_with_spans",
        "tokenize_conversation", "tokenize_conversations",
    ),
    "nemo_dflash.data.config": ("DataConfig", "DataSourceConfig", "as_data_config", "validate_data_config"),
    "nemo_dflash.data.dataset": (
        "ChatCollator", "ChatDataset", "build_dataloader", "build_datasets", "collate", "pad_token_id_of",
        "split_holdout",
    ),
    "nemo_dflash.data.sampler": ("ChatBatchSampler",),
    "nemo_dflash.data.sources": (
        "SHAREGPT_FILE", "BadRecordCounter", "Conversation", "DataError", "apply_weight", "normalize_record",
        "read_conversations",
    ),
}

__getattr__, __dir__, __all__ = lazy_exports(globals(), _EXPORTS)  # every lazily loaded name is public
