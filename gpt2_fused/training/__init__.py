"""What the commands (train.py, sample.py, eval_hellaswag.py) are built from, one concern a
module; README.md's "Files" says where this package sits among the others. Nothing here runs on
import.
"""
