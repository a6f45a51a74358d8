"""The recall model's training data: the workload's own documents and questions, answers masked exactly.

Training itself takes minutes and runs where the engine tests build the model (the held-out recall it reached is
in the folder's recall.json and `build_recall_model` refuses a model below MIN_RECALL)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from blackbox.vocabulary import CODE_WORDS
from blackbox.workload import question_for
from servers import recall_model
from servers.recall_model import _Data
from servers.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> _Data:
    from transformers import PreTrainedTokenizerFast

    folder: Path = build_tiny_model(tmp_path_factory.mktemp("tiny"), 0)
    return _Data(PreTrainedTokenizerFast.from_pretrained(folder), 0, 0.85)


@pytest.mark.parametrize("repeat", [False, True])
def test_only_codes_are_answers_and_each_follows_its_question(data: _Data, repeat: bool) -> None:
    rng = random.Random(3)
    for _ in range(20):
        ids, mask = data.example(rng, (4, 12), 40, (2, 4), repeat)
        assert len(ids) == len(mask)
        words = data.tok.convert_ids_to_tokens(ids)
        answers = [w for w, m in zip(words, mask, strict=True) if m]
        assert answers and len(answers) % 3 == 0
        assert set(answers) <= set(CODE_WORDS)
        text = " ".join(words)
        asked = [i for i in range(len(words)) if words[i : i + 5] == "what is the code of".split()]
        for at in asked:  # each question's answer is the code its document states for that name
            question = question_for(words[at + 5]).split()
            assert words[at : at + len(question)] == question
            start = at + len(question) + 3  # <|im_end|> <|im_start|> assistant
            assert words[start - 3 : start] == ["<|im_end|>", "<|im_start|>", "assistant"]
            code = " ".join(words[start : start + 3])
            assert all(mask[start : start + 3]) and f"the code of {words[at + 5]} is {code} ." in text
        # a repeated fact's code is an answer too, and only then are there more answers than questions ask
        assert (len(answers) > 3 * len(asked)) == repeat


def test_stories_follow_the_planted_successor_as_the_model_does(data: _Data) -> None:
    ids = data.tok.encode(data.story(random.Random(1), 400), add_special_tokens=False)
    followed = sum(int(data.f[a]) == b for a, b in itertools.pairwise(ids)) / (len(ids) - 1)
    assert 0.8 < followed < 0.9


def test_the_shipped_weights_are_those_of_the_shipped_recipe() -> None:
    # A changed recipe (steps, seed, planted model, thread count) without new weights would silently retrain in
    # every fresh checkout; new weights without the recipe would be served under the wrong name.
    from safetensors import safe_open

    assert recall_model.ASSET.is_file(), "run: python -m servers.recall_model --out .blackbox-cache --write-asset"
    with safe_open(str(recall_model.ASSET), "pt") as f:
        meta = f.metadata()
    assert meta["recipe"] == recall_model.recipe(0, recall_model.Training())
    assert json.loads(meta["report"])["heldout_recall"] >= recall_model.MIN_RECALL


def test_a_recorded_recipe_is_assembled_without_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    planted = build_tiny_model(tmp_path / "cache", 0)
    trained = tmp_path / "cache" / "trained"
    trained.mkdir()
    tensors = load_file(str(planted / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"] = tensors["model.layers.1.self_attn.o_proj.weight"] * 2
    save_file(tensors, str(trained / "model.safetensors"))
    (trained / "recall.json").write_text(json.dumps({"heldout_recall": 0.97}))
    monkeypatch.setattr(recall_model, "ASSET", tmp_path / "weights.safetensors")
    recall_model.write_asset(trained)
    assert set(load_file(str(tmp_path / "weights.safetensors"))) == {"model.layers.1.self_attn.o_proj.weight"}

    def no_training(*args: object) -> None:
        raise AssertionError("trained although the asset holds this recipe")

    monkeypatch.setattr(recall_model, "_train", no_training)
    built = recall_model.build_recall_model(tmp_path / "cache")
    rebuilt = load_file(str(built / "model.safetensors"))
    assert set(rebuilt) == set(tensors) and all(torch.equal(rebuilt[k], tensors[k]) for k in tensors)
    assert json.loads((built / "recall.json").read_text())["weights_from"] == "weights.safetensors"
    assert (built / "tokenizer.json").read_bytes() == (planted / "tokenizer.json").read_bytes()
    # another recipe (here: another seed) is not served from these weights
    monkeypatch.setattr(recall_model, "_train", lambda *a: {"heldout_recall": 0.0})
    with pytest.raises(RuntimeError, match="held-out recall"):
        recall_model.build_recall_model(tmp_path / "cache", seed=1)


def test_trained_tensors_go_back_into_the_checkpoint_layout(tmp_path: Path) -> None:
    # transformers fuses the routed experts; the saved checkpoint keeps one tensor per expert (as vLLM loads it)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    planted = build_tiny_model(tmp_path, 0)
    tensors = load_file(str(planted / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(planted, dtype=torch.float32)
    state = model.state_dict()
    assert recall_model._checkpoint_tensors(state, tensors).keys() == tensors.keys()
    assert all(torch.equal(a, tensors[k]) for k, a in recall_model._checkpoint_tensors(state, tensors).items())
    state["model.layers.0.mlp.experts.gate_up_proj"][2, 64:] += 1.0  # expert 2's up projection
    changed = recall_model._checkpoint_tensors(state, tensors)
    assert [k for k in tensors if not torch.equal(changed[k], tensors[k])] == [
        "model.layers.0.mlp.experts.2.up_proj.weight"
    ]
