"""``python -m tierckpt.agent serve|status|flush ...``."""

import sys

from tierckpt.agent.cli import standalone

sys.exit(standalone())
