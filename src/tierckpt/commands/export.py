"""stub"""
from __future__ import annotations

import argparse

HELP = "stub"
STORAGE = True
def add_arguments(p: argparse.ArgumentParser) -> None:
    pass
def main(args: argparse.Namespace) -> int:
    return 0
