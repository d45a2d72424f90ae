__version__ = "0.1.0"

# The distribution's name on the package index (pyproject.toml's [project] name): `pip install collectives-py`
# installs the import package `collectives` ("collectives" on the index is an unrelated project).
DISTRIBUTION = "collectives-py"
