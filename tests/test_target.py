"""Hook capture vs HF's own output_hidden_states; validation; hook hygiene."""

import pytest
import torch

from _tiny_models import random_batch, train_llama, train_qwen3
from nemo_dflash.target import HFDFlashTargetModel, find_decoder_layers


@pytest.mark.parametrize("factory", [train_qwen3, train_llama])
@pytest.mark.parametrize("ids", [[0, 2], [1, 3], [2]])
def test_capture_equals_output_hidden_states(factory, ids):
    model = factory()
    x, attn, lm = random_batch()
    with torch.no_grad():
        ref = model(input_ids=x, attention_mask=attn, output_hidden_states=True).hidden_states
    wrapper = HFDFlashTargetModel(model, ids)
    expected = torch.cat([ref[i + 1] for i in ids], dim=-1)
    for need_logits in (False, True):  # early-stopped and full forwards
        batch = wrapper.generate_batch(x, attn, lm, return_logits=need_logits)
        torch.testing.assert_close(batch.hidden_states, expected, rtol=0, atol=0)
        assert (batch.logits is not None) == need_logits
    assert batch.hidden_states.shape == (x.shape[0], x.shape[1], len(ids) * model.config.hidden_size)


def test_early_stop_skips_later_layers():
    model = train_qwen3(num_layers=6)
    calls = []
    layers = find_decoder_layers(model)
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, layer in enumerate(layers)]
    wrapper = HFDFlashTargetModel(model, [1, 2])
    x, attn, lm = random_batch()
    wrapper.generate_batch(x, attn, lm)
    for h in handles:
        h.remove()
    assert calls == [0, 1, 2]


@pytest.mark.parametrize("ids", [[], [6], [-1], [1, 1]])
def test_bad_layer_ids_are_rejected(ids):
    with pytest.raises(ValueError, match="target_layer_ids"):
        HFDFlashTargetModel(train_qwen3(num_layers=6), ids)


def _num_hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def test_raising_forward_leaves_no_hook():
    model = train_qwen3()
    wrapper = HFDFlashTargetModel(model, [1, 3])
    assert _num_hooks(model) == 0

    def boom(*_):
        raise RuntimeError("boom")

    h = find_decoder_layers(model)[0].register_forward_pre_hook(boom)
    x, attn, lm = random_batch()
    with pytest.raises(RuntimeError, match="boom"):
        wrapper.generate_batch(x, attn, lm)
    h.remove()
    assert _num_hooks(model) == 0
    wrapper.generate_batch(x, attn, lm)  # still works afterwards
    assert _num_hooks(model) == 0


def test_layer_discovery_layouts():
    model = train_qwen3()

    class Wrapped(torch.nn.Module):  # e.g. a VLM holding the text model under language_model
        def __init__(self):
            super().__init__()
            self.language_model = model

    assert len(find_decoder_layers(Wrapped())) == model.config.num_hidden_layers
    assert len(find_decoder_layers(model.model)) == model.config.num_hidden_layers  # `layers` directly
    with pytest.raises(ValueError, match="decoder layers"):
        find_decoder_layers(torch.nn.Linear(2, 2))


def test_target_is_frozen_and_exposes_embeddings():
    model = train_llama()
    wrapper = HFDFlashTargetModel(model, [1])
    assert not any(p.requires_grad for p in model.parameters())
    assert wrapper.get_input_embeddings() is model.get_input_embeddings()
    assert wrapper.get_output_embeddings() is model.get_output_embeddings()


def test_unknown_packaged_target_names_the_known_ones(tmp_path, capsys):
    """A mistyped pkg: name gets the list of packaged targets, not 'not a local directory' (one line, exit 2)."""
    import pytest

    from nemo_dflash.target.loading import resolve_target_path
    from nemo_dflash.recipes import regenerate

    with pytest.raises(FileNotFoundError, match="pkg:smollm2"):
        resolve_target_path("pkg:smollm3")
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(SystemExit) as exc:
        regenerate.main(["--target", "pkg:smollm3", "--data", str(data), "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "packaged targets are: pkg:smollm2" in err and "Traceback" not in err


@pytest.mark.parametrize("factory", [train_qwen3, train_llama])
def test_random_weight_targets_have_their_rotary_tables(factory):
    """`random_weight_model` (`target.random_init`, the benchmarks' targets) builds on the meta device and
    allocates with ``to_empty``, which leaves buffers as whatever memory held: the rotary tables must equal HF's
    own, and a forward be finite. Memory filled with NaN first, so leftovers cannot pass by chance."""
    from nemo_dflash.target.loading import random_weight_model

    reference = factory()
    config = reference.config
    junk = [torch.full((1 << 16,), float("nan")) for _ in range(64)]  # freed: to_empty may reuse these blocks
    del junk
    model = random_weight_model(config, "cpu", torch.float32, seed=0)
    ours = {n: b for n, b in model.named_buffers()}
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(ours[name], buf, rtol=0, atol=0)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    x, attn, _ = random_batch()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=x, attention_mask=attn).logits).all()
