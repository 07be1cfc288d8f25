# /etc/profile.d/dflash-trainenv.sh: login shells in the Proxmox container use the frozen venv.
# The venv is read-only there; `dflash-doctor` compares it with the lock it was built from.
export VIRTUAL_ENV=/opt/venv
case ":$PATH:" in *":/opt/venv/bin:"*) ;; *) export PATH="/opt/venv/bin:$PATH" ;; esac
