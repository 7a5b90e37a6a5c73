"""engine.kind synthetic: the engine contract without a model, generating random token ids at
a configured rate (a test and capacity tool; see engines/synthetic/engine.py)."""

from engines.synthetic.engine import SyntheticEngine
from engines.synthetic.settings import SETTINGS, SyntheticSettings

__all__ = ["SETTINGS", "SyntheticEngine", "SyntheticSettings"]
