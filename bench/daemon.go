package bench

import (
	"context"
	"fmt"
	"os/exec"
	"strings"

	"github.com/engramfs/engramfs/internal/daemonproc"
)

// startDaemon runs `bin mount --log-format json [flags] modelDir MOUNTPOINT`
// on a fresh mountpoint under mountDir (empty: the system's temporary
// directory) and returns once it has mounted. env, if not empty, is added to
// the daemon's environment. The daemon runs as its own process so that its
// CPU time and memory can be read from /proc, apart from the reader's; a
// failure's error holds the warnings and errors of its JSON log.
func startDaemon(ctx context.Context, bin, mountDir string, flags, env []string, modelDir string) (*daemonproc.Daemon, error) {
	return daemonproc.Start(ctx, daemonproc.Options{
		Binary:   bin,
		ModelDir: modelDir,
		Flags:    append([]string{"--log-format", "json"}, flags...),
		Env:      env,
		MountDir: mountDir,
	})
}

// DaemonFlags returns the flags `bin mount --help` lists (without dashes),
// so the bench passes a flag only to a daemon that knows it.
func DaemonFlags(bin string) (map[string]bool, error) {
	out, _ := exec.Command(bin, "mount", "--help").CombinedOutput() // --help exits 0; a usage error would not list flags anyway
	flags := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		t := strings.TrimSpace(line)
		if name, ok := strings.CutPrefix(t, "-"); ok {
			name = strings.TrimPrefix(name, "-")
			if f := strings.Fields(name); len(f) > 0 {
				flags[f[0]] = true
			}
		}
	}
	if !flags["queue-depth"] {
		return nil, fmt.Errorf("%s mount --help lists no --queue-depth: not an engramfs binary?\n%s", bin, out)
	}
	return flags, nil
}

// daemonEnv is what the bench adds to every daemon's environment
// (--daemon-gomaxprocs).
func daemonEnv(cfg *Config) []string {
	if cfg.DaemonGOMAXPROCS > 0 {
		return []string{fmt.Sprintf("GOMAXPROCS=%d", cfg.DaemonGOMAXPROCS)}
	}
	return nil
}
