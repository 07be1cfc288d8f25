"""Unit tests of the PVE test host's logic: schema checks, property strings, config files, UPIDs, perms."""

import pytest

from tests.pve_testhost import pveconf, schema
from tests.pve_testhost.containers import Node, PermError
from tests.pve_testhost.tasks import make_upid, parse_upid

CREATE = "/nodes/{node}/lxc"
PUT_CONFIG = "/nodes/{node}/lxc/{vmid}/config"


def errors_of(template, method, params):
    with pytest.raises(schema.ParamError) as exc:
        schema.validate(template, method, params)
    return exc.value.errors


def test_valid_create_is_typed():
    out = schema.validate(CREATE, "POST", {"node": "pve", "vmid": "200", "ostemplate": "local:vztmpl/x.tar.zst",
                                           "memory": "2048", "unprivileged": "true", "cpulimit": "1.5",
                                           "net0": "name=eth0,bridge=vmbr0,ip=dhcp", "dev0": "/dev/nvidia0"})
    assert out["vmid"] == 200 and out["memory"] == 2048 and out["unprivileged"] == 1 and out["cpulimit"] == 1.5


def test_unknown_and_raw_lxc_keys_are_refused_with_pves_message():
    errs = errors_of(CREATE, "POST", {"node": "pve", "vmid": "200", "ostemplate": "local:vztmpl/x.tar.zst",
                                      "lxc.cgroup2.devices.allow": "c 195:* rwm", "colour": "blue"})
    assert errs == {"lxc.cgroup2.devices.allow": schema.UNKNOWN_KEY, "colour": schema.UNKNOWN_KEY}
    assert schema.UNKNOWN_KEY == ("property is not defined in schema and the schema does not allow "
                                  "additional properties")


def test_missing_required_types_ranges_and_enums():
    errs = errors_of(CREATE, "POST", {"node": "pve", "vmid": "99", "memory": "lots", "ostype": "windows",
                                      "swap": "-1", "password": "abc", "console": "maybe"})
    assert errs == {
        "ostemplate": "property is missing and it is not optional",
        "vmid": "value must have a minimum value of 100",
        "memory": "type check ('integer') failed - got 'lots'",
        "ostype": "value 'windows' does not have a value in the enumeration 'debian, devuan, ubuntu, centos, "
                  "fedora, opensuse, archlinux, alpine, gentoo, nixos, unmanaged'",
        "swap": "value must have a minimum value of 0",
        "password": "value must be at least 5 characters long",
        "console": "type check ('boolean') failed - got 'maybe'",
    }


def test_indexed_keys_have_pves_limits():
    base = {"node": "pve", "vmid": "100"}
    assert errors_of(PUT_CONFIG, "PUT", {**base, "net32": "name=eth0"}) == {"net32": schema.UNKNOWN_KEY}
    assert schema.validate(PUT_CONFIG, "PUT", {**base, "net31": "name=eth31"})["net31"] == "name=eth31"
    assert errors_of(PUT_CONFIG, "PUT", {**base, "dev01": "/dev/null"}) == {"dev01": schema.UNKNOWN_KEY}


def test_property_strings_are_checked_inside():
    base = {"node": "pve", "vmid": "100"}
    errs = errors_of(PUT_CONFIG, "PUT", {**base, "net0": "bridge=vmbr0", "dev0": "/dev/nvidia0,mode=666",
                                         "features": "nesting=1,gpu=1", "mp0": "local:8"})
    assert errs["net0"] == "invalid format - format error\nname: property is missing and it is not optional"
    assert errs["dev0"] == "invalid format - format error\nmode: value does not match the regex pattern"
    assert errs["features"] == f"invalid format - format error\ngpu: {schema.UNKNOWN_KEY}"
    assert errs["mp0"] == "invalid format - format error\nmp: property is missing and it is not optional"
    errs = errors_of(PUT_CONFIG, "PUT", {**base, "dev1": "/tmp/x", "net1": "name=eth1,ip=10.0.0.5"})
    assert errs["dev1"].startswith("invalid format - format error\npath: invalid format - value '/tmp/x'")
    assert "IPv4 network configuration" in errs["net1"]


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
    assert conf.description == "GPU trainer"
    assert conf.values == {"arch": "amd64", "memory": "2048", "unprivileged": "1"}
    assert conf.lxc == [("lxc.cgroup2.devices.allow", "c 195:* rwm"),
                        ("lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind")]
    assert conf.pending == {"memory": "4096"} and conf.pending_delete == ["cores"]
    assert len(conf.digest) == 40
    again = pveconf.parse(pveconf.render(conf))
    assert (again.values, again.lxc, again.pending, again.pending_delete) == \
        (conf.values, conf.lxc, conf.pending, conf.pending_delete)
    pveconf.apply_pending(conf)
    assert conf.values["memory"] == "4096" and not conf.pending


def test_upid_has_pves_format():
    upid = make_upid("pve", 0x1234, 0x5678, 0xAABBCCDD, "vzcreate", "100", "root@pam!ci")
    assert upid == "UPID:pve:00001234:00005678:AABBCCDD:vzcreate:100:root@pam!ci:"
    assert parse_upid(upid) == {"node": "pve", "pid": 0x1234, "pstart": 0x5678, "starttime": 0xAABBCCDD,
                                "type": "vzcreate", "id": "100", "user": "root@pam!ci"}
    with pytest.raises(ValueError, match="unable to parse worker upid"):
        parse_upid("UPID:pve:1234")


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
