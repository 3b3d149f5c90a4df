"""Configuration files and values, validated once at the boundary."""

from elastic_control.config.data_config import DataConfig, load_data_config, parse_data_config
from elastic_control.config.resources import Resources
from elastic_control.config.slot_conf import SlotConf, load_slot_conf, parse_slot_conf

__all__ = [
    "DataConfig",
    "load_data_config",
    "parse_data_config",
    "Resources",
    "SlotConf",
    "load_slot_conf",
    "parse_slot_conf",
]
