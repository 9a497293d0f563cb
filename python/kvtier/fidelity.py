"""The stable import path of the codec fidelity tool (``python -m kvtier.fidelity``,
the ``kvtier-fidelity`` command), kvtier/integrations/hf/fidelity.py."""
from kvtier.integrations.hf.fidelity import *  # noqa: F403
from kvtier.integrations.hf.fidelity import __all__, main  # noqa: F401

if __name__ == "__main__":
    import sys

    sys.exit(main())
