"""Print the host's pip configuration as one pip.conf (argv[1]) and, one per line on stdout, the
local paths it names (CA bundle, find-links, file:// indexes), so a build can mount them and
reach the same package index the host reaches."""
import os
import subprocess
import sys
from pathlib import Path


def host_pip_settings() -> dict:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
    settings = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[1]] = value.strip().strip("'").replace("\\n", "\n")
    for name, value in os.environ.items():
        if name.startswith("PIP_") and name != "PIP_CONFIG_FILE":
            settings[name[4:].lower().replace("_", "-")] = value
    return settings


def local_paths(settings: dict) -> set:
    paths = set()
    for value in settings.values():
        for word in value.split():
            path = word[len("file://"):] if word.startswith("file://") else word
            if path.startswith("/") and Path(path).exists():
                # a local index's pages link files beside it (<root>/simple -> <root>/files)
                paths.add(str(Path(path).parent) if Path(path).name == "simple" else path)
    return paths


if __name__ == "__main__":
    settings = host_pip_settings()
    body = "".join(f"{k} = {v.replace(chr(10), chr(10) + '    ')}\n" for k, v in settings.items())
    Path(sys.argv[1]).write_text("[global]\n" + body)
    print("\n".join(sorted(local_paths(settings))))
