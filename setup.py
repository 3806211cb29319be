"""Packaging hook: pyproject.toml holds the metadata; this file only maps the top-level
``assets/`` folder (the layout is fixed) into the wheel as the package ``kvscope_assets``,
read with ``importlib.resources.files("kvscope_assets")``. pyproject's
``[tool.setuptools]`` tables cannot map a folder to a package while also discovering the
others, hence this file."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["engine*", "inspector*", "kernels*"])
    + ["kvscope_assets"],
    package_dir={"kvscope_assets": "assets"},
    package_data={"": ["*.json", "*.jinja"], "kvscope_assets": ["*.kvtrace", "workloads/*.json"]},
)
