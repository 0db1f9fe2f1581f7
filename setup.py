"""megamoe-plugin is packaged by pyproject.toml (setuptools backend); this file only lets tools that still call
``python setup.py ...`` or look for it find the project. Nothing is configured here."""
from setuptools import setup

setup()
