"""Packaging hook: pyproject.toml holds the metadata; this file maps the repository's
fixed top-level folders under the one import package ``kvscope``, so that an install adds
nothing else to someone's environment (a vLLM or SGLang venv, for the plugins):

    assets/     -> kvscope            (its __init__.py; the data files are package data)
    engine/     -> kvscope.engine
    inspector/  -> kvscope.inspector
    kernels/    -> kvscope.kernels

pyproject's ``[tool.setuptools]`` tables cannot map folders to packages while also
discovering their subpackages, hence this file."""

from setuptools import find_packages, setup

ROOMS = ("engine", "inspector", "kernels")

packages = ["kvscope"]
package_dir = {"kvscope": "assets"}
for room in ROOMS:
    package_dir[f"kvscope.{room}"] = room
    packages += [f"kvscope.{p}" for p in find_packages(include=[room, f"{room}.*"])]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"": ["*.json", "*.jinja", "*.c", "*.h"],
                  "kvscope": ["*.kvtrace", "workloads/*.json"]},
)
