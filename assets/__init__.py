"""kvscope's data files (sample recording, workload definitions), installed as the package
``kvscope_assets`` (see setup.py) and read with ``importlib.resources.files("kvscope_assets")``."""
