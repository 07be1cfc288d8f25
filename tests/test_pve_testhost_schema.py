"""Unit tests of the PVE test host's logic: schema checks, property strings, config files, UPIDs, tasks, perms.

The expected texts are PVE's own; each test names the upstream function they come from.
"""

import json
import threading

import pytest

from tests.pve_testhost import pveconf, schema
from tests.pve_testhost.api import status_type
from tests.pve_testhost.containers import Node, PermError, PveError, parse_size
from tests.pve_testhost.tasks import TaskManager, make_upid, parse_upid, split_token_user

CREATE = "/nodes/{node}/lxc"
PUT_CONFIG = "/nodes/{node}/lxc/{vmid}/config"
UPLOAD = "/nodes/{node}/storage/{storage}/upload"
BASE = {"node": "pve", "vmid": "100"}


def errors_of(template, method, params):
    with pytest.raises(schema.ParamError) as exc:
        schema.validate(template, method, params)
    return exc.value.errors


def test_valid_create_is_typed():
    out = schema.validate(CREATE, "POST", {"node": "pve", "vmid": "200", "ostemplate": "local:vztmpl/x.tar.zst",
                                           "memory": "2048", "unprivileged": "1", "cpulimit": "1.5",
                                           "net0": "name=eth0,bridge=vmbr0,ip=dhcp", "dev0": "/dev/nvidia0",
                                           "description": "GPU trainer\nsecond line"})
    assert out["vmid"] == 200 and out["memory"] == 2048 and out["unprivileged"] == 1 and out["cpulimit"] == 1.5
    assert out["description"] == "GPU trainer\nsecond line"


def test_description_is_part_of_create_update_and_the_config_pve_returns():
    """pve-container LXC/Config.pm $confdesc: description, a string of at most 8 KiB, in create
    (API2/LXC.pm create_vm), PUT config (API2/LXC/Config.pm update_vm) and GET config's return."""
    for path, method in ((CREATE, "POST"), (PUT_CONFIG, "PUT")):
        sch = schema.method_schema(path, method)["parameters"]["properties"]["description"]
        assert sch == {"maxLength": 8192, "optional": 1, "type": "string"}
    returned = schema.method_schema(PUT_CONFIG, "GET")["returns"]["properties"]
    assert returned["description"]["type"] == "string"
    errs = errors_of(PUT_CONFIG, "PUT", {**BASE, "description": "x" * 8193})
    assert errs == {"description": "value may only be 8192 characters long"}


def test_booleans_are_0_or_1_at_the_top_level_and_words_only_inside_property_strings():
    """JSONSchema.pm check_type: a top-level boolean must be '0' or '1' (a JSON true/false too; the
    API server converts nothing); parse_property_string turns on/yes/true into 1 first."""
    errs = errors_of(PUT_CONFIG, "PUT", {**BASE, "onboot": "true"})
    assert errs == {"onboot": "type check ('boolean') failed - got 'true'"}
    assert schema.validate(PUT_CONFIG, "PUT", {**BASE, "onboot": "1"})["onboot"] == 1
    assert schema.parse_config_value("net0", "name=eth0,firewall=yes")["firewall"] == 1


def test_unknown_and_raw_lxc_keys_are_refused_with_pves_message():
    errs = errors_of(CREATE, "POST", {"node": "pve", "vmid": "200", "ostemplate": "local:vztmpl/x.tar.zst",
                                      "lxc.cgroup2.devices.allow": "c 195:* rwm", "colour": "blue"})
    assert errs == {"lxc.cgroup2.devices.allow": schema.UNKNOWN_KEY, "colour": schema.UNKNOWN_KEY}
    assert schema.UNKNOWN_KEY == ("property is not defined in schema and the schema does not allow "
                                  "additional properties")


def test_missing_required_types_ranges_and_enums():
    errs = errors_of(CREATE, "POST", {"node": "pve", "vmid": "100", "memory": "lots", "ostype": "windows",
                                      "swap": "-1", "password": "abc", "console": "maybe", "cores": "9000"})
    assert errs == {
        "ostemplate": "property is missing and it is not optional",
        "memory": "type check ('integer') failed - got 'lots'",
        "ostype": "value 'windows' does not have a value in the enumeration 'debian, devuan, ubuntu, centos, "
                  "fedora, opensuse, archlinux, alpine, gentoo, nixos, unmanaged'",
        "swap": "value must have a minimum value of 0",
        "password": "value must be at least 5 characters long",
        "console": "type check ('boolean') failed - got 'maybe'",
        "cores": "value must have a maximum value of 8192",
    }


@pytest.mark.parametrize("vmid", ["99", "12", "0100", "1000000000"])
def test_vmid_outside_pves_range_gets_the_vm_id_format_message(vmid):
    """pve-common JSONSchema.pm: check_prop checks the format before minimum/maximum, and
    pve_verify_vmid dies "value does not look like a valid VM ID\\n" (newline included)."""
    assert errors_of(CREATE, "POST", {"node": "pve", "vmid": vmid, "ostemplate": "local:vztmpl/x.tar.zst"}) == {
        "vmid": "invalid format - value does not look like a valid VM ID\n"}


def test_bad_ip_in_net0_gets_pves_property_string_message():
    """pve-container LXC/Config.pm $netconf_desc: ip has format pve-ipv4-config (pve-common
    JSONSchema.pm pve_verify_ipv4_config: dhcp, manual or a CIDR with a prefix of 8..32);
    parse_property_string reports it as "format error" plus '<key path>: <message>' lines
    (PVE::Exception stringify), and check_prop prefixes "invalid format - "."""
    def net0_error(value):
        return errors_of(PUT_CONFIG, "PUT", {**BASE, "net0": value})["net0"]

    bad_ipv4 = ("invalid format - format error\n"
                "net0.ip: invalid format - value does not look like a valid ipv4 network configuration\n\n")
    assert net0_error("name=eth0,bridge=vmbr0,ip=10.0.0.5") == bad_ipv4
    assert net0_error("name=eth0,bridge=vmbr0,ip=10.0.0.5/4") == bad_ipv4  # prefix below 8
    assert net0_error("name=eth0,bridge=vmbr0,ip=300.0.0.5/24") == bad_ipv4
    assert net0_error("name=eth0,ip6=fe80::1") == (
        "invalid format - format error\n"
        "net0.ip6: invalid format - value does not look like a valid ipv6 network configuration\n\n")
    assert net0_error("name=eth0,gw=10.0.0") == (
        "invalid format - format error\nnet0.gw: invalid format - value does not look like a valid IPv4 address\n\n")
    for good in ("name=eth0,bridge=vmbr0,ip=dhcp", "name=eth0,ip=10.0.0.5/24,gw=10.0.0.1", "name=eth0,ip6=auto",
                 "name=eth0,ip6=fd00::5/64"):
        schema.validate(PUT_CONFIG, "PUT", {**BASE, "net0": good})


@pytest.mark.parametrize("hostname", ["gpu_box", "-gpu", "gpu-", "gpu..box"])
def test_hostname_that_is_no_dns_name_gets_pves_message(hostname):
    """pve-container $confdesc hostname: format dns-name (pve-common JSONSchema.pm pve_verify_dns_name:
    labels of letters, digits and inner hyphens)."""
    assert errors_of(PUT_CONFIG, "PUT", {**BASE, "hostname": hostname}) == {
        "hostname": "invalid format - value does not look like a valid DNS name\n"}
    schema.validate(PUT_CONFIG, "PUT", {**BASE, "hostname": "gpu-box.example.org"})


def test_indexed_keys_have_pves_limits():
    assert errors_of(PUT_CONFIG, "PUT", {**BASE, "net32": "name=eth0"}) == {"net32": schema.UNKNOWN_KEY}
    assert schema.validate(PUT_CONFIG, "PUT", {**BASE, "net31": "name=eth31"})["net31"] == "name=eth31"
    assert errors_of(PUT_CONFIG, "PUT", {**BASE, "dev01": "/dev/null"}) == {"dev01": schema.UNKNOWN_KEY}


def test_property_strings_are_checked_inside():
    """JSONSchema.pm parse_property_string + check_object, keyed by '<param>.<key>'."""
    errs = errors_of(PUT_CONFIG, "PUT", {**BASE, "net0": "bridge=vmbr0", "dev0": "/dev/nvidia0,mode=666",
                                         "features": "nesting=1,gpu=1", "mp0": "local:8"})
    assert errs["net0"] == "invalid format - format error\nnet0.name: property is missing and it is not optional\n"
    assert errs["dev0"] == "invalid format - format error\ndev0.mode: value does not match the regex pattern\n"
    assert errs["features"] == f"invalid format - format error\nfeatures.gpu: {schema.UNKNOWN_KEY}\n"
    assert errs["mp0"] == "invalid format - format error\nmp0.mp: property is missing and it is not optional\n"
    errs = errors_of(PUT_CONFIG, "PUT", {**BASE, "dev1": "/tmp/x", "net1": "name=eth1,name=eth2",
                                         "net2": "eth0", "mp1": "local:8,mp=/srv/../etc"})
    # pve-container LXC/Config.pm verify_lxc_dev_string / verify_lxc_mp_string
    assert errs["dev1"] == "invalid format - format error\ndev1.path: invalid format - /tmp/x is not a valid device path\n\n"
    assert errs["mp1"] == ("invalid format - format error\n"
                           "mp1.mp: invalid format - /srv/../etc contains illegal character sequences\n\n")
    assert errs["net1"] == "invalid format - duplicate key in comma-separated list property: name\n"
    assert errs["net2"] == "invalid format - value without key, but schema does not define a default key\n"


def test_requires_reports_the_missing_partner():
    """JSONSchema.pm check_object: 'requires' puts the error on the key that is missing."""
    errs = errors_of(UPLOAD, "POST", {"node": "pve", "storage": "local", "content": "vztmpl", "filename": "x.tar.zst",
                                      "checksum": "ab" * 32})
    assert errs == {"checksum-algorithm": "missing property required by 'checksum'"}


def test_every_format_the_schema_names_is_checked():
    """No format of lxc-endpoints.json may pass unchecked (PVE dies on an undefined format)."""
    names = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("format"), str):
                names.add(node["format"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(schema.SCHEMA_FILE.read_text())["endpoints"])
    bases = {n.removesuffix("-list").removesuffix("-opt") for n in names}
    assert bases and bases <= set(schema.FORMATS), bases - set(schema.FORMATS)
    with pytest.raises(schema.FormatError, match="undefined format 'no-such-format'"):
        schema.check_format("no-such-format", "x", "x")


def test_the_schema_is_the_corrected_copy():
    """The test host validates against its own copy of the PVE 9.1 schema subset (README); the copy
    carries description in create, PUT config and GET config."""
    endpoints = schema.endpoints()
    assert "description" in endpoints[CREATE]["POST"]["parameters"]["properties"]
    assert "description" in endpoints[PUT_CONFIG]["GET"]["returns"]["properties"]


def test_property_string_parse_and_print_round_trip_in_pves_order():
    net = schema.parse_config_value("net0", "bridge=vmbr0,name=eth0,ip=dhcp,firewall=1,mtu=1500")
    assert net == {"bridge": "vmbr0", "name": "eth0", "ip": "dhcp", "firewall": 1, "mtu": 1500}
    assert schema.print_config_value("net0", net) == "name=eth0,bridge=vmbr0,firewall=1,ip=dhcp,mtu=1500"
    mp = schema.parse_config_value("mp0", "local:8,mp=/data,ro=1")
    assert mp == {"volume": "local:8", "mp": "/data", "ro": 1}
    assert schema.print_config_value("mp0", {"mp": "/data", "volume": "/srv/x", "backup": 0}) == \
        "/srv/x,mp=/data,backup=0"
    dev = schema.parse_config_value("dev0", "/dev/nvidia0,gid=44,mode=0666,deny-write=1")
    assert dev == {"path": "/dev/nvidia0", "gid": 44, "mode": "0666", "deny-write": 1}
    assert schema.parse_config_value("rootfs", "local:8") == {"volume": "local:8"}
    assert schema.parse_config_value("features", "nesting=1,keyctl=1,mount=nfs;cifs") == \
        {"nesting": 1, "keyctl": 1, "mount": "nfs;cifs"}
    assert [schema.mountpoint_type(v) for v in ("local:8", "/srv/x", "/dev/sdb1")] == ["volume", "bind", "device"]


def test_config_file_round_trip_with_raw_lines_and_pending():
    text = ("#GPU trainer\narch: amd64\nmemory: 2048\nunprivileged: 1\n"
            "lxc.cgroup2.devices.allow: c 195:* rwm\nlxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind\n"
            "\n[pve:pending]\nmemory: 4096\ndelete: cores\n")
    conf = pveconf.parse(text)
    assert conf.description == "GPU trainer\n"  # parse_pct_config: every comment line ends in "\n"
    assert conf.values == {"arch": "amd64", "memory": "2048", "unprivileged": "1"}
    assert conf.lxc == [("lxc.cgroup2.devices.allow", "c 195:* rwm"),
                        ("lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind")]
    assert conf.pending == {"memory": "4096"} and conf.pending_delete == ["cores"]
    assert len(conf.digest) == 40
    again = pveconf.parse(pveconf.render(conf))
    assert (again.values, again.lxc, again.pending, again.pending_delete, again.description) == \
        (conf.values, conf.lxc, conf.pending, conf.pending_delete, conf.description)
    pveconf.apply_pending(conf)
    assert conf.values["memory"] == "4096" and not conf.pending


def test_description_is_stored_as_encoded_comment_lines():
    """pve-container write_pct_config writes '#'+encode_text(line) per line; encode_text (pve-common
    ParseUtils.pm) escapes ':', '%' and every non-printable byte; parse_pct_config decodes each
    line and ends it with a newline."""
    conf = pveconf.CtConfig(values={"memory": "512"}, description="GPU box: 2 x H200\n\n100% busy – ok")
    text = pveconf.render(conf)
    assert text.splitlines()[:3] == ["#GPU box%3A 2 x H200", "#", "#100%25 busy %E2%80%93 ok"]
    assert pveconf.parse(text).description == "GPU box: 2 x H200\n\n100% busy – ok\n"


def test_upid_keeps_the_token_and_task_status_splits_it():
    """pve-common UPID.pm encode keeps the full user (a token's is 'root@pam!ci', as HTTPServer.pm
    auth_handler sets it); pve-manager API2/Tasks.pm convert_token_task splits it into user and tokenid."""
    upid = make_upid("pve", 0x1234, 0x5678, 0xAABBCCDD, "vzcreate", "100", "root@pam!ci")
    assert upid == "UPID:pve:00001234:00005678:AABBCCDD:vzcreate:100:root@pam!ci:"
    assert parse_upid(upid) == {"node": "pve", "pid": 0x1234, "pstart": 0x5678, "starttime": 0xAABBCCDD,
                                "type": "vzcreate", "id": "100", "user": "root@pam!ci"}
    assert split_token_user("root@pam!ci") == {"user": "root@pam", "tokenid": "ci"}
    assert split_token_user("root@pam") == {"user": "root@pam"}
    for bad in ("UPID:pve:1234", "UPID:pve:00001234:00005678:AABBCCDD:imgdel:local:vztmpl/x:root@pam:"):
        with pytest.raises(ValueError, match="unable to parse worker upid"):
            parse_upid(bad)


def test_task_status_and_list_entry_of_a_token_task(tmp_path):
    """read_task_status and node_tasks (pve-manager API2/Tasks.pm) of a failed task: user/tokenid
    split; the error's newlines become blanks (pve-common RESTEnvironment.pm fork_worker)."""
    tasks = TaskManager("pve", tmp_path)
    release = threading.Event()

    def work(task):
        task.log("doing it")
        release.wait(10)
        raise PveError("first line\nsecond line\n")

    upid = tasks.start("vzstart", "100", "root@pam!ci", work)
    running = tasks.get(upid)
    assert running.status_dict()["status"] == "running" and "exitstatus" not in running.status_dict()
    assert running.list_entry()["status"] == "RUNNING"
    release.set()
    task = tasks.wait(upid, timeout=10)
    st = task.status_dict()
    assert (st["user"], st["tokenid"], st["status"], st["exitstatus"]) == (
        "root@pam", "ci", "stopped", "first line second line")
    assert ":vzstart:100:root@pam!ci:" in st["upid"]
    assert task.lines == ["doing it", "TASK ERROR: first line second line"]
    entry = task.list_entry()
    assert entry["status"] == "first line second line" and entry["endtime"] >= entry["starttime"]
    assert "exitstatus" not in entry and entry["tokenid"] == "ci"


def test_task_status_types_are_pves():
    """pve-common UPID.pm normalize_status_type, which node_tasks' errors/statusfilter use."""
    assert [status_type(s) for s in ("OK", "WARNINGS: 2", "unable to create CT 100 - x", None,
                                     "unexpected status")] == ["ok", "warning", "error", "unknown", "unknown"]


def test_sizes_parse_like_pves_parse_size():
    """pve-common JSONSchema.pm parse_size (the rootfs size= that vmstatus reports as maxdisk)."""
    assert [parse_size(s) for s in ("4G", "512M", "1.5G", "8", "2T", None, "lots")] == [
        4 * 1024 ** 3, 512 * 1024 ** 2, int(1.5 * 1024 ** 3), 8, 2 * 1024 ** 4, 0, 0]


@pytest.mark.parametrize("new,message", [
    ({"dev0": "/dev/nvidia0"}, "configuring device passthrough is only allowed for root@pam"),
    ({"mp0": "/srv/data,mp=/data"}, "mount point type bind is only allowed for root@pam"),
    ({"features": "nesting=1,keyctl=1"}, "changing feature flags (except nesting) is only allowed for root@pam"),
    ({"hookscript": "local:snippets/x.sh"}, "changing the hookscript is only allowed for root@pam"),
])
def test_root_only_rules_refuse_tokens(new, message):
    with pytest.raises(PermError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Node.check_modify_perm("root@pam!ci", None, new, [], True)
    Node.check_modify_perm("root@pam", None, new, [], True)  # root@pam passes every rule


def test_tokens_may_change_nesting_on_unprivileged_cts_only():
    Node.check_modify_perm("root@pam!ci", None, {"features": "nesting=1", "memory": "1024", "mp0": "local:8,mp=/x"},
                           [], True)
    with pytest.raises(PermError, match="privileged container"):
        Node.check_modify_perm("root@pam!ci", None, {"features": "nesting=1"}, [], False)
