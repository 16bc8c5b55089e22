"""Chat-data pipeline: read conversations, tokenise with the target's chat template, batch.

The data a draft trains on is made here too: prompt sources (`sources`, `prompts`), regeneration's selection
(`selection`), answers (`regenerate`, `openai_backend`), journals and rank merging (`journals`), the run's
steps (`regen_run`) and numbers (`regen_stats`), and the data report (`report`).
"""

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

__all__ = [
    "BadRecordCounter",
    "ChatBatchSampler",
    "ChatCollator",
    "ChatDataset",
    "ChatFormat",
    "ChatTemplateError",
    "Conversation",
    "DataConfig",
    "DataError",
    "DataSourceConfig",
    "TokenizedConversation",
    "apply_weight",
    "as_data_config",
    "build_dataloader",
    "build_datasets",
    "collate",
    "detect_chat_format",
    "normalize_record",
    "pad_token_id_of",
    "read_conversations",
    "render_with_spans",
    "split_holdout",
    "tokenize_conversation",
    "tokenize_conversations",
    "validate_data_config",
]
