"""`megalite-plan --search`: the fastest predicted layouts that fit (megalite/plan/search.py),
printed as a table or JSON, optionally plotted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megalite.config.errors import ConfigError
from megalite.config.schema import check_sections, load_config
from megalite.plan.auto import search_recipes
from megalite.plan.devices import DeviceProfile
from megalite.plan.report import explicit_layout_keys, plot_search, ranking_table
from megalite.plan.search import NothingFits
from megalite.utils.extras import install_hint, missing


def run_search(args, profile: DeviceProfile, per_node: int) -> int:
    """Exit status: 0, 2 for a bad configuration (or --plot without matplotlib), 4 when
    nothing fits."""
    if args.plot and missing("matplotlib"):
        print(f"megalite: --plot needs matplotlib, which comes with the eval extra: "
              f"{install_hint('eval')} (or leave --plot out)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.overrides)
        check_sections(cfg)
    except ConfigError as e:
        print(f"megalite: bad configuration: {e}", file=sys.stderr)
        return 2
    fixed = explicit_layout_keys(args.overrides, cfg)
    try:
        result, recipes = search_recipes(cfg, args.world_size, profile, per_node, args.top,
                                         fixed, args.document_tokens)
    except NothingFits as e:
        print(f"megalite: {e}", file=sys.stderr)
        return 4
    except ConfigError as e:  # fp8.recipe=auto on a profile without FP8
        print(f"megalite: bad configuration: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # e.g. the profile has no rate for the run's precision
        print(f"megalite: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"fixed": fixed, "fp8_recipes_step_s": recipes,
                          "valid": result.valid, "costed": result.costed,
                          "too_big_bytes": result.too_big, "invalid": result.invalid,
                          "best": [{"overrides": r.choice.overrides(),
                                    "peak_bytes": r.peak_bytes,
                                    "prediction": r.prediction.as_dict()}
                                   for r in result.best]}, indent=1))
    else:
        print(ranking_table(result, profile, args.world_size, per_node, fixed))
        if recipes:
            print(f"fp8.recipe=auto: {result.best[0].config.fp8.recipe} (fastest layout "
                  "predicted: " + ", ".join(f"{r} {t * 1e3:.3g} ms" for r, t in recipes.items())
                  + " a step)")
    if args.plot:
        plot_search(result, profile, Path(args.plot))
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
