// Command statsdoc writes the table of stats in docs/operations.md from
// stats.Fields, between the lines <!-- stats:begin --> and <!-- stats:end -->.
// It runs from `go generate ./internal/stats`; TestDocsTableIsGenerated fails
// when the committed table is not what it would write.
//
//	go run ./internal/stats/statsdoc docs/operations.md
package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/engramfs/engramfs/internal/stats"
)

const (
	beginMarker = "<!-- stats:begin -->"
	endMarker   = "<!-- stats:end -->"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: statsdoc DOC.md")
		os.Exit(2)
	}
	if err := generate(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "statsdoc:", err)
		os.Exit(1)
	}
}

// generate rewrites the table in the file at path, leaving the file alone
// when it is already current.
func generate(path string) error {
	doc, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	out, err := splice(doc, table(stats.Fields))
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if bytes.Equal(out, doc) {
		return nil
	}
	return os.WriteFile(path, out, 0o644)
}

// splice replaces the lines between the markers of doc with body.
func splice(doc []byte, body string) ([]byte, error) {
	b := bytes.Index(doc, []byte(beginMarker+"\n"))
	e := bytes.Index(doc, []byte(endMarker))
	switch {
	case b < 0 || e < 0:
		return nil, fmt.Errorf("want a line %s and a line %s", beginMarker, endMarker)
	case e < b || bytes.Count(doc, []byte(beginMarker)) != 1 || bytes.Count(doc, []byte(endMarker)) != 1:
		return nil, errors.New("want one begin marker, then one end marker")
	}
	b += len(beginMarker) + 1
	out := make([]byte, 0, len(doc)+len(body))
	out = append(out, doc[:b]...)
	out = append(out, body...)
	return append(out, doc[e:]...), nil
}

// table is the markdown of fields: a row per field, a bold row per group.
func table(fields []stats.Field) string {
	var w strings.Builder
	w.WriteString("<!-- Made by `go generate ./internal/stats` from internal/stats/fields.go: edit Fields there, not this table. -->\n\n")
	w.WriteString("| field | kind | unit | meaning | Prometheus metric |\n|---|---|---|---|---|\n")
	group := ""
	for _, f := range fields {
		if f.Group != group {
			group = f.Group
			fmt.Fprintf(&w, "| **%s** | | | | |\n", group)
		}
		unit, metric := f.Unit, "—"
		if unit == "" {
			unit = "—"
		}
		if f.Metric != "" {
			metric = "`engramfs_" + f.Metric
			if f.PerLayer() {
				metric += "{layer}"
			}
			metric += "`"
		}
		fmt.Fprintf(&w, "| `%s` | %s | %s | %s | %s |\n", f.Name, f.Kind, unit, escape(f.Meaning), metric)
	}
	return w.String()
}

// escape keeps a meaning inside its table cell.
func escape(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
