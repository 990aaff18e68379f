"""rlhfkit.options: --help describes every option, --config files under command-line overrides, typed errors."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import load_example

from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.hybrid import HybridConfig
from rlhfkit.lora import LoraConfig
from rlhfkit.options import field_descriptions, parse_options

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
OPTION_EXAMPLES = sorted(path.stem for path in EXAMPLES.glob("*.py") if "parse_options(Options" in path.read_text())


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Run:
    """A script's options.

    Attributes:
        model: HF folder or hub id of the policy.
        steps, lr: training steps, and the learning rate
            (continued on a second line, 100% kept).
    """

    model: str | None = None
    steps: int = 3
    lr: float = 1e-3
    resident: bool = False  # nothing sleeps
    overlap: bool | None = None  # None: decided at start
    targets: tuple[str, ...] = ("q_proj",)  # modules to adapt
    deepspeed: DeepSpeedEngineConfig = dataclasses.field(
        default_factory=lambda: DeepSpeedEngineConfig(optimizer="torch_adamw", bf16=False))


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _help(cls: type, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_options(cls, ["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", OPTION_EXAMPLES)
def test_every_example_option_has_its_description_in_help(name, capsys):
    options = load_example(name).Options
    descriptions = field_descriptions(options)
    fields = [field.name for field in dataclasses.fields(options) if field.init]
    assert set(descriptions) == set(fields), f"undescribed fields of {name}.Options: {set(fields) - set(descriptions)}"
    shown = _squeezed(_help(options, capsys))
    for field in fields:
        assert "--" + field.replace("_", "-") in shown, field
        assert _squeezed(descriptions[field]) in shown, (field, descriptions[field])
    assert load_example(name).Options.__name__ == "Options" and parse_options(options, []) == options()


def test_descriptions_come_from_metadata_docstring_and_comments(capsys):
    descriptions = field_descriptions(_Run)
    assert descriptions["model"] == "HF folder or hub id of the policy."
    assert descriptions["steps"] == descriptions["lr"] == ("training steps, and the learning rate (continued on a "
                                                           "second line, 100% kept).")
    assert descriptions["resident"] == "nothing sleeps"
    shown = _squeezed(_help(_Run, capsys))
    assert _squeezed("100% kept") in shown and _squeezed("(default: 0.001)") in shown
    # a library config documents each field in its docstring's Attributes section
    assert set(field_descriptions(HybridConfig)) == {f.name for f in dataclasses.fields(HybridConfig)}
    assert field_descriptions(HybridConfig)["tensor_parallel_size"].endswith("GPUs per vLLM engine.")


def test_types_bools_none_and_sequences():
    assert parse_options(_Run, []) == _Run()
    parsed = parse_options(_Run, ["--model", "m", "--steps", "7", "--lr", "0.5", "--resident", "TRUE",
                                  "--overlap", "false", "--targets", "q_proj", "v_proj"])
    assert parsed == dataclasses.replace(_Run(), model="m", steps=7, lr=0.5, resident=True, overlap=False,
                                         targets=("q_proj", "v_proj"))
    assert parse_options(_Run, ["--model", "none", "--overlap", "none"]).model is None
    assert parse_options(_Run, ["--resident", "no"]).resident is False


def test_a_dataclass_field_is_a_group_of_options_built_into_it():
    parsed = parse_options(_Run, ["--deepspeed-zero-stage", "2", "--deepspeed-learning-rate", "3e-4"])
    assert parsed.deepspeed == DeepSpeedEngineConfig(optimizer="torch_adamw", bf16=False, zero_stage=2,
                                                     learning_rate=3e-4)  # the default instance's other fields kept
    with pytest.raises(ValueError, match="zero_stage"):  # the nested config's own validation
        parse_options(_Run, ["--deepspeed-zero-stage", "7"])
    lora = parse_options(LoraConfig, ["--rank", "4", "--target-modules", "q_proj", "v_proj"])
    assert lora == LoraConfig(rank=4, target_modules=("q_proj", "v_proj"))
    hybrid = parse_options(HybridConfig, ["--model", "m", "--device", "cpu", "--engine", "hf", "--num-gpus", "2"])
    assert (hybrid.model, hybrid.device, hybrid.num_gpus, hybrid.overlap) == ("m", "cpu", 2, False)


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_config_file_under_command_line_overrides(suffix, tmp_path):
    values = {"steps": 9, "lr": 0.25, "resident": True, "overlap": None, "targets": ["k_proj", "o_proj"],
              "deepspeed": {"zero_stage": 1, "gradient_clipping": 0.5}}
    path = tmp_path / f"run.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(values))
    else:
        import yaml

        path.write_text(yaml.safe_dump(values))
    from_file = parse_options(_Run, ["--config", str(path)])
    assert (from_file.steps, from_file.lr, from_file.resident, from_file.targets) == (9, 0.25, True,
                                                                                   ("k_proj", "o_proj"))
    assert (from_file.deepspeed.zero_stage, from_file.deepspeed.gradient_clipping) == (1, 0.5)
    assert from_file.model is None  # not in the file: the default
    overridden = parse_options(_Run, ["--steps", "2", "--config", str(path), "--deepspeed-zero-stage", "0"])
    assert (overridden.steps, overridden.lr, overridden.deepspeed.zero_stage) == (2, 0.25, 0)


def test_errors_name_the_option_and_the_value(tmp_path, capsys):
    for argv, words in ((["--steps", "x"], ("--steps", "'x'")), (["--resident", "maybe"], ("--resident", "'maybe'")),
                        (["--deepspeed-zero-stage", "two"], ("--deepspeed", "'two'"))):
        with pytest.raises(SystemExit) as exit_info:
            parse_options(_Run, argv)
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert all(word in error for word in words), error
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: unknown option\(s\) \['stepz'\]"):
        parse_options(_Run, ["--config", str(bad)])
    bad.write_text("steps: 3.5\n")  # a value of the wrong type in a file is refused as on the command line
    with pytest.raises(SystemExit):
        parse_options(_Run, ["--config", str(bad)])
    assert "'3.5'" in capsys.readouterr().err


def test_unsupported_fields_without_defaults_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Untyped:
        table: dict

    with pytest.raises(TypeError, match="option field 'table'"):
        parse_options(Untyped, [])
    with pytest.raises(TypeError, match="needs a dataclass type"):
        parse_options(_Run(), [])
