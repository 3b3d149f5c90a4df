"""The packages, and templates/ shipped inside the wheel as ``elastic_control/templates`` (everything else: setup.cfg).

templates/ stays at the top of the repository; a package_dir mapping installs it as package data, so a wheel
renders what the checkout renders.
"""

from setuptools import find_packages, setup

TEMPLATES = "elastic_control.templates"

setup(
    packages=[*find_packages(include=["ctr_foundation*", "elastic_control*", "cube*", "client*"]), TEMPLATES],
    package_dir={TEMPLATES: "templates"},
    package_data={TEMPLATES: ["*.j2"], "ctr_foundation.grpc_api": ["*.proto"]},
)
