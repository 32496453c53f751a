package main

import (
	"bufio"
	"flag"
	"io"
	"os"
	osexec "os/exec"
	"strings"
	"testing"
)

// The files in deploy/ name flags and options of this binary: they must
// keep parsing as the binary changes.

func TestSystemdUnitFlagsParse(t *testing.T) {
	unit, err := os.ReadFile("../../deploy/engramfs@.service")
	if err != nil {
		t.Fatal(err)
	}
	conf, err := os.ReadFile("../../deploy/engramfs.conf.example")
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"STATE_DIRECTORY": "/var/lib/engramfs"}
	sc := bufio.NewScanner(strings.NewReader(string(conf)))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			env[k] = v
		}
	}
	exec := unitSetting(string(unit), "ExecStart")
	if !strings.Contains(string(unit), "Type=notify") || !strings.Contains(string(unit), "LimitMEMLOCK=infinity") {
		t.Fatal("the unit is not Type=notify with LimitMEMLOCK=infinity")
	}
	words := strings.Fields(os.Expand(strings.ReplaceAll(exec, "%i", "dsv41"), func(k string) string { return env[k] }))
	if len(words) < 4 || words[1] != "mount" {
		t.Fatalf("ExecStart %q is not engramfs mount", exec)
	}
	fl := flag.NewFlagSet("mount", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	var mf mountFlags
	mf.register(fl)
	mf.logFlags.register(fl)
	if err := fl.Parse(words[2:]); err != nil {
		t.Fatalf("ExecStart flags %q: %v", words[2:], err)
	}
	if fl.NArg() != 2 || fl.Arg(0) != env["MODEL_DIR"] || mf.stateFile != "/var/lib/engramfs/dsv41.state" || mf.cacheSize != "4G" {
		t.Fatalf("ExecStart parsed to %+v, args %q", mf, fl.Args())
	}
}

// unitSetting is the value of the unit's line key=..., or "".
func unitSetting(unit, key string) string {
	for _, l := range strings.Split(unit, "\n") {
		if v, ok := strings.CutPrefix(l, key+"="); ok {
			return v
		}
	}
	return ""
}

// The unit wires the takeover: reload is engramfs restart on the mount,
// the daemon may keep its connection in the fd store and say MAINPID=
// from a new process, and the stop's unmount runs on a real stop, never
// after a crash (the mount the restart takes over). The ExecStopPost line
// is run as systemd runs it (its $$ a literal dollar), with the binary
// replaced by echo.
func TestSystemdUnitWiresTheTakeover(t *testing.T) {
	b, err := os.ReadFile("../../deploy/engramfs@.service")
	if err != nil {
		t.Fatal(err)
	}
	unit := string(b)
	for key, want := range map[string]string{
		"ExecReload":             "/usr/local/bin/engramfs restart ${MOUNTPOINT}",
		"FileDescriptorStoreMax": "1",
		"NotifyAccess":           "all",
		"Restart":                "on-failure",
	} {
		if got := unitSetting(unit, key); got != want {
			t.Errorf("%s=%q, want %q", key, got, want)
		}
	}
	reload := strings.Fields(unitSetting(unit, "ExecReload"))
	fl := newFlagSet("restart", "", "")
	fl.Duration("timeout", 0, "")
	if err := fl.Parse(reload[2:]); err != nil || fl.NArg() != 1 {
		t.Fatalf("ExecReload %q does not parse as engramfs restart MOUNTPOINT: %v", reload, err)
	}
	post, ok := strings.CutPrefix(unitSetting(unit, "ExecStopPost"), "-")
	if !ok {
		t.Fatalf("ExecStopPost=%q: want a failure ignored (-)", unitSetting(unit, "ExecStopPost"))
	}
	post = strings.ReplaceAll(post, "$$", "$")
	post = strings.ReplaceAll(post, "${MOUNTPOINT}", "/mnt/dsv41")
	post = strings.ReplaceAll(post, "/usr/local/bin/engramfs", "echo")
	for result, want := range map[string]string{
		"success":   "unmount /mnt/dsv41",
		"timeout":   "unmount /mnt/dsv41",
		"signal":    "",
		"core-dump": "",
		"exit-code": "",
	} {
		cmd := osexec.Command("/bin/sh", "-c", post)
		cmd.Env = append(os.Environ(), "SERVICE_RESULT="+result)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("ExecStopPost with SERVICE_RESULT=%s: %v", result, err)
		}
		if got := strings.TrimSpace(string(out)); got != want {
			t.Errorf("ExecStopPost with SERVICE_RESULT=%s ran %q, want %q", result, got, want)
		}
	}
}

func TestFstabExampleParses(t *testing.T) {
	b, err := os.ReadFile("../../deploy/fstab.example")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		if len(f) != 6 || f[2] != "fuse.engramfs" {
			t.Fatalf("fstab line %q: want 6 fields of type fuse.engramfs", l)
		}
		h, err := parseHelperArgs([]string{f[0], f[1], "-o", f[3]})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := mountArgs(h, io.Discard); err != nil {
			t.Fatalf("fstab line %q: %v", l, err)
		}
		n++
	}
	if n == 0 {
		t.Fatal("no fstab line in the example")
	}
}
