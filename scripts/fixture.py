"""Writing a reference fixture of the gen_*_reference.py scripts."""
import json
import os


def write_fixture(name, data):
    """Writes `data` as JSON to tests/data/`name`; returns the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "tests", "data", name)
    with open(path, "w") as f:
        json.dump(data, f)
    return path
