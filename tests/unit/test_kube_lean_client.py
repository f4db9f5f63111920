"""The lean kubernetes_asyncio: the same classes, imported when first used; the whole library
where it was imported already or is laid out differently. Each case in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=env, timeout=120).stdout
    result: dict[str, object] = json.loads(out.splitlines()[-1])
    return result


def test_the_adapters_get_the_lean_client_and_every_name_they_use_resolves():
    result = run(
        "import json, sys\n"
        "import vgpu_agent.kube.node, vgpu_agent.kube.pods, vgpu_agent.kube.resourceslices\n"
        "from vgpu_agent.kube import leanclient\n"
        "from kubernetes_asyncio import client, config, watch\n"
        "import kubernetes_asyncio.client.models as models\n"
        "before = sum(m.startswith('kubernetes_asyncio.client.models.') for m in sys.modules)\n"
        "names = [client.ApiClient, client.Configuration, client.CoreV1Api, client.ResourceV1Api,"
        " client.V1DeleteOptions, client.V1Preconditions, models.V1PodIP, client.ApiException,"
        " client.rest, config.load_kube_config, watch.Watch]\n"
        "try:\n"
        "    client.V1NoSuchThing\n"
        "    missing = 'resolved'\n"
        "except AttributeError as err:\n"
        "    missing = str(err)\n"
        "print(json.dumps({'lean': leanclient.is_lean(), 'models_before': before,"
        " 'names': [getattr(n, '__name__', '') for n in names], 'missing': missing}))\n"
    )
    assert result["lean"] is True
    assert result["models_before"] <= 5  # of some 770 model modules
    assert result["names"][:7] == ["ApiClient", "Configuration", "CoreV1Api", "ResourceV1Api",
                                   "V1DeleteOptions", "V1Preconditions", "V1PodIP"]
    assert "V1NoSuchThing" in str(result["missing"])


def test_every_class_of_the_whole_library_is_found_where_the_lean_client_looks():
    # the whole library's own map of names to modules, against the lean client's file names
    result = run(
        "import json, inspect\n"
        "import kubernetes_asyncio.client as client\n"
        "from vgpu_agent.kube import leanclient\n"
        "wrong = [n for n, c in vars(client).items() if inspect.isclass(c)"
        " and c.__module__.startswith(('kubernetes_asyncio.client.models.',"
        " 'kubernetes_asyncio.client.api.'))"
        " and c.__module__.rsplit('.', 1)[1] != leanclient.module_name(n)]\n"
        "count = sum(inspect.isclass(c) for c in vars(client).values())\n"
        "print(json.dumps({'installed': leanclient.install(), 'wrong': wrong, 'count': count}))\n"
    )
    assert result["installed"] is False  # imported whole first: left as it is
    assert result["count"] > 800
    assert result["wrong"] == []


def test_a_library_laid_out_differently_is_imported_whole():
    result = run(
        "import json, sys\n"
        "from vgpu_agent.kube import leanclient\n"
        "sys.modules.pop('kubernetes_asyncio', None)\n"
        "for m in [m for m in sys.modules if m.startswith('kubernetes_asyncio.')]:\n"
        "    del sys.modules[m]\n"
        "leanclient.REQUIRED = (*leanclient.REQUIRED, 'kubernetes_asyncio.client.no_such_module')\n"
        "installed = leanclient.install()\n"
        "from kubernetes_asyncio import client\n"
        "print(json.dumps({'installed': installed, 'lean': leanclient.is_lean(),"
        " 'pod': client.V1Pod.__name__}))\n"
    )
    assert result == {"installed": False, "lean": False, "pod": "V1Pod"}


def test_the_in_cluster_loader_comes_without_the_kubeconfig_loader_until_that_is_used():
    # an agent in a cluster loads incluster_config only; the package's own __init__ (the
    # kubeconfig loader, yaml) runs into the same module on the first use of another name
    result = run(
        "import json, sys\n"
        "import vgpu_agent.kube.node, vgpu_agent.kube.pods, vgpu_agent.kube.resourceslices\n"
        "from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader\n"
        "from kubernetes_asyncio import config\n"
        "watched = ('yaml', 'kubernetes_asyncio.config.kube_config')\n"
        "before = [m for m in watched if m in sys.modules]\n"
        "names = [config.load_kube_config, config.load_config, config.load_incluster_config,"
        " config.ConfigException, config.new_client_from_config]\n"
        "after = [m for m in watched if m in sys.modules]\n"
        "try:\n"
        "    config.no_such_name\n"
        "    missing = 'resolved'\n"
        "except AttributeError as err:\n"
        "    missing = str(err)\n"
        "print(json.dumps({'before': before, 'after': after, 'location':"
        " config.KUBE_CONFIG_DEFAULT_LOCATION, 'loader': InClusterConfigLoader.__name__,"
        " 'names': [n.__module__ + '.' + n.__name__ for n in names], 'missing': missing}))\n"
    )
    assert result["before"] == []
    assert result["after"] == ["yaml", "kubernetes_asyncio.config.kube_config"]
    assert result["loader"] == "InClusterConfigLoader"
    assert str(result["location"]).endswith(".kube/config")
    assert result["names"] == [
        "kubernetes_asyncio.config.kube_config.load_kube_config",
        "kubernetes_asyncio.config.load_config",
        "kubernetes_asyncio.config.incluster_config.load_incluster_config",
        "kubernetes_asyncio.config.config_exception.ConfigException",
        "kubernetes_asyncio.config.kube_config.new_client_from_config",
    ]
    assert "no_such_name" in str(result["missing"])
