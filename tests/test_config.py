import pytest
import tomllib

from recaccel.config import Config, config_from_dict, config_to_toml, load_config
from recaccel.errors import ConfigError


def test_presets_load(repo_root):
    for path in sorted((repo_root / "configs").glob("*.toml")):
        cfg = load_config(path)
        assert isinstance(cfg, Config)


def test_overrides_are_typed_from_dataclass_fields():
    cfg = load_config(
        None,
        [
            "train.steps=7",
            "model.top_mlp=[8, 1]",
            "model.embedding_backend=reference",
            "optim.lr=1",
            "train.progress=false",
        ],
    )
    assert cfg.train.steps == 7
    assert cfg.model.top_mlp == [8, 1]
    assert cfg.model.embedding_backend == "reference"
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.progress is False


def test_override_beats_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 3\n")
    assert load_config(path).train.steps == 3
    assert load_config(path, ["train.steps=4"]).train.steps == 4


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.stesp=5", "did you mean train.steps"),
        ("trian.steps=5", "did you mean train"),
        ("train.steps=abc", "train.steps=abc must be an integer"),
        ("train.steps=1.5", "train.steps=1.5 must be an integer"),
        ("optim.lr=fast", "optim.lr=fast must be a number"),
        ("train.progress=1", "train.progress=1 must be true or false"),
        ("model.top_mlp=3", "model.top_mlp=3 must be a list"),
        ("model.top_mlp=[1, 'a']", "model.top_mlp[1]=a must be an integer"),
        ("data.invalid_ids=clipp", "did you mean clip"),
        ("steps=5", "must look like section.key"),
        ("train.steps", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = ")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)


def test_resolved_toml_round_trips():
    sets = ["train.steps=9", "synth.num_sparse=2", "synth.cardinalities=[3, 4]", 'train.out_dir="a \\"b\\""']
    cfg = load_config(None, sets)
    assert config_from_dict(tomllib.loads(config_to_toml(cfg))) == cfg
