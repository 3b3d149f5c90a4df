"""slot.conf, data.config and resource-flag parsing: the values and the error messages."""

from __future__ import annotations

import datetime as dt

import pytest

from ctr_foundation.errors import ConfigError, UsageError
from elastic_control.config import Resources, load_data_config, load_slot_conf, parse_data_config, parse_slot_conf

GOOD = """\
# comment
export HDFS_ADDRESS="hdfs://nn:9000"
export HDFS_UGI="root,i"
export START_DATE_HR=20191221/00
export END_DATE_HR=20191221/03
export DATASET_PATH="/data/${SUB}"
export SPARSE_DIM="1000001"   # trailing comment
MODEL_PATH='${NOT_EXPANDED}/models'
"""


def test_slot_conf_ignores_comments_and_blank_lines():
    conf = parse_slot_conf("# header\n\n1\n 2 \n3  # trailing\n")
    assert conf.slots == (1, 2, 3)
    assert conf.index_of() == {1: 0, 2: 1, 3: 2}
    assert conf.to_text() == "1\n2\n3\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("1\nx\n", r"slot.conf:2: slot id 'x' is not an integer"),
        ("1\n2\n1\n", r"slot.conf:3: slot 1 is listed twice \(first on line 1\)"),
        ("-4\n", r"slot.conf:1: slot id -4 is negative"),
        ("# only comments\n\n", r"slot.conf: no slots listed"),
        ("", r"no slots listed"),
        # dense slots (SLOT dense)
        ("1\n3 dense dense\n", r"slot.conf:2: '3 dense dense' is not 'SLOT' or 'SLOT dense'"),
        ("1\n3 sparse\n", r"slot.conf:2: '3 sparse' is not 'SLOT' or 'SLOT dense'"),
        ("3\n4\n3 dense\n", r"slot.conf:3: slot 3 is listed twice \(first on line 1\)"),
        ("3 dense\n1\n3\n", r"slot.conf:3: slot 3 is listed twice \(first on line 1\)"),
        ("40 dense\n41 dense\n", r"slot.conf: no sparse slot listed \(dense slots need at least one\)"),
        ("1\nx dense\n", r"slot.conf:2: slot id 'x' is not an integer"),
        ("1\n-40 dense\n", r"slot.conf:2: slot id -40 is negative"),
    ],
)
def test_slot_conf_errors_name_file_line_and_value(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_slot_conf(text)


def test_slot_conf_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.conf: file not found \(pass the slot list with -s/--slot_conf\)"):
        load_slot_conf(tmp_path / "nope.conf")


def test_slot_conf_is_a_usage_error_exit_2():
    with pytest.raises(UsageError) as info:
        parse_slot_conf("")
    assert info.value.exit_code == 2


def test_slot_conf_dense_slots_and_to_text_round_trip():
    conf = parse_slot_conf("1\n40 dense\n2   # sparse\n\t41\tdense  # tab-separated\n3\n")
    assert conf.slots == (1, 2, 3) and conf.dense == (40, 41)
    assert conf.index_of() == {1: 0, 2: 1, 3: 2}  # the embedding positions: sparse slots only
    # to_text writes the sparse slots, then the dense ones: each kind keeps its own order
    assert conf.to_text() == "1\n2\n3\n40 dense\n41 dense\n"
    again = parse_slot_conf(conf.to_text())
    assert (again.slots, again.dense) == (conf.slots, conf.dense)


def test_slot_conf_criteo_slot_conf_as_data_criteo_writes_it(tmp_path):
    from elastic_control.data.criteo import CATEGORICAL_SLOTS, DENSE_SLOTS, INTEGER_SLOTS, slot_conf_text

    path = tmp_path / "slot.conf"
    path.write_text(slot_conf_text())
    conf = load_slot_conf(path)
    assert conf.slots == INTEGER_SLOTS + CATEGORICAL_SLOTS and conf.dense == DENSE_SLOTS == tuple(range(40, 53))


def test_data_config_values_expansion_and_quotes():
    cfg = parse_data_config(GOOD, env={"SUB": "ctr"})
    assert cfg.hdfs_address == "hdfs://nn:9000"
    assert cfg.dataset_path == "/data/ctr"
    assert cfg.dataset_root == "hdfs://nn:9000/data/ctr"
    assert cfg.sparse_dim == 1000001
    assert cfg.model_path == "${NOT_EXPANDED}/models"  # single quotes are literal
    assert cfg.start == dt.datetime(2019, 12, 21, 0) and cfg.end == dt.datetime(2019, 12, 21, 3)
    assert [h.hour for h in cfg.hours()] == [0, 1, 2, 3]
    assert cfg.hour_dir(cfg.start) == "hdfs://nn:9000/data/ctr/20191221/00"
    assert cfg.data_format == "text" and cfg.online is False


def test_data_config_default_expansion_and_earlier_keys():
    text = (
        "export START_DATE_HR=20200101/05\nexport END_DATE_HR=20200101/05\n"
        'export ROOTX="${MISSING:-/fallback}"\nexport DATASET_PATH="${START_DATE_HR}"\n'
    )
    cfg = parse_data_config(text, env={})
    assert cfg.dataset_path == "20200101/05"
    assert cfg.values["ROOTX"] == "/fallback"


def test_the_example_data_config_parses(monkeypatch):
    monkeypatch.delenv("ELASTIC_CTR_DATASET", raising=False)
    cfg = load_data_config("examples/data.config")
    assert cfg.dataset_path == "/tmp/elastic-ctr/data"
    assert cfg.sparse_dim == 1000001


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "export START_DATE_HR=2019-12-21",
            r"data.config:1: START_DATE_HR='2019-12-21' is not a date and hour in the "
            r"format YYYYMMDD/HH",
        ),
        ("export START_DATE_HR=20191321/00", r"START_DATE_HR='20191321/00' is not a date and hour"),
        ("export START_DATE_HR 20191221/00", r"data.config:1: cannot parse .* \(expected: export KEY=\"VALUE\"\)"),
        ('export START_DATE_HR="20191221/00', r"data.config:1: unterminated double quote"),
        ("export START_DATE_HR=$(date)", r"shell syntax"),
        ("export START_DATE_HRR=20191221/00", r"unknown key 'START_DATE_HRR'; did you mean 'START_DATE_HR'\?"),
        ("export START_DATE_HR=${UNDEFINED_THING}", r"\$\{UNDEFINED_THING\} is not defined"),
    ],
)
def test_data_config_errors_name_file_line_and_value(line, message):
    rest = "export END_DATE_HR=20191221/01\nexport DATASET_PATH=/d\n"
    with pytest.raises(ConfigError, match=message):
        parse_data_config(line + "\n" + rest, env={})


@pytest.mark.parametrize(
    "extra, message",
    [
        ("export SPARSE_DIM=0", r"SPARSE_DIM='0' must be a positive integer"),
        ("export DATA_FORMAT=csv", r"DATA_FORMAT='csv' must be 'text' or 'parquet'"),
        ("export ONLINE=maybe", r"ONLINE='maybe' must be 0 or 1"),
        ("export END_DATE_HR=20191220/00", r"END_DATE_HR 20191220/00 is before START_DATE_HR"),
    ],
)
def test_data_config_value_checks(extra, message):
    text = "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\nexport DATASET_PATH=/d\n" + extra + "\n"
    with pytest.raises(ConfigError, match=message):
        parse_data_config(text, env={})


def test_data_config_required_keys():
    with pytest.raises(
        ConfigError,
        match=r"DATASET_PATH is missing \(required keys: START_DATE_HR, END_DATE_HR, "
        r"DATASET_PATH\)",
    ):
        parse_data_config("export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\n", env={})


def test_data_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"file not found \(pass the data description with -f/--datafile\)"):
        load_data_config(tmp_path / "data.config")


def test_resources_accept_the_documented_example():
    r = Resources(cpu=4, mem=20, trainers=2, pservers=2, cube_shards=5)
    assert (r.cpu, r.mem, r.cube_shards) == (4, 20, 5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("cpu", 0, r"-u/--cpu 0 is out of range: CPU cores per trainer/pserver pod must be between 1 and 256"),
        ("mem", 2000, r"-m/--mem 2000 is out of range"),
        ("trainers", 0, r"-t/--trainer 0 is out of range"),
        ("pservers", "2", r"-p/--pserver must be an integer"),
        ("cube_shards", True, r"-b/--cube must be an integer"),
    ],
)
def test_resources_reject_out_of_range(field, value, message):
    with pytest.raises(UsageError, match=message):
        Resources(**{field: value})
