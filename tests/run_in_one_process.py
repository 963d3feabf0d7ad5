"""Runs many command lines of one kit script in one process (the imports are the slow part) and
prints, as JSON after "RESULTS ", how each main() ended: "finished without an error", or the message
it stopped with (SystemExit's text, exactly as it would end a command-line run).

    PYTHONPATH=. python tests/run_in_one_process.py online_dpo '[["--response_length", "0"], ...]'
"""

import importlib
import json
import sys

import cli

if __name__ == "__main__":
    module = importlib.import_module(sys.argv[1])
    results = []
    for argv in json.loads(sys.argv[2]):
        sys.argv = [module.__file__, *argv]
        try:
            module.main(cli.parse(module.Args))
            results.append("finished without an error")
        except SystemExit as stop:
            results.append(str(stop.code))
    print("RESULTS " + json.dumps(results))
