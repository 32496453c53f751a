package daemonproc

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// hexDump matches a line of the stack dump a Go crash on a signal prints.
var hexDump = regexp.MustCompile(`^[0-9a-f]{16}: `)

// Summary says what in the daemon's output matters when something failed:
// its warnings and errors (the first of each message, from JSON log lines),
// the first lines it printed that are not JSON log lines (a crash's reason
// comes before its goroutine dump; with the console log format, its first
// log lines), and its last 2 KiB.
func (d *Daemon) Summary() string {
	log := d.Log()
	var out []string
	seen := map[string]bool{}
	raw := 0
	for _, line := range strings.Split(log, "\n") {
		var e struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
		}
		switch {
		case json.Unmarshal([]byte(line), &e) == nil:
			if e.Level != "info" && e.Level != "debug" && !seen[e.Msg] {
				seen[e.Msg] = true
				out = append(out, line)
			}
		case raw < 20 && line != "" && !strings.HasPrefix(line, "\t") && !strings.HasPrefix(line, " ") && !hexDump.MatchString(line):
			// A crash prints its reason, then goroutines, then (for a
			// signal) a hex dump of the stack: keep the reason.
			raw++
			out = append(out, line)
		}
	}
	return fmt.Sprintf("daemon log (%d bytes); its warnings, errors and first other lines:\n%s\n... and its last lines:\n%s",
		len(log), strings.Join(out, "\n"), log[max(0, len(log)-2048):])
}
