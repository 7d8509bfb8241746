// Command kube-control-plane is one binary holding a private Kubernetes control plane for the
// tests: etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl, each built
// from the pinned upstream modules (go.mod) and chosen by the first argument or by the name the
// binary is called by (a link named kubectl runs kubectl).
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

const usage = `usage: kube-control-plane COMPONENT [FLAGS...]

COMPONENT is one of:
  etcd                      etcd server (the API server's storage)
  kube-apiserver            the Kubernetes API server
  kube-scheduler            the scheduler
  kube-controller-manager   the controllers (Job, garbage collector, node lifecycle, ...)
  kubectl                   the command-line client

Each takes its upstream flags. A link to this binary named after a component runs it.
`

func main() {
	component := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if !known(component) {
		if len(args) == 0 || !known(args[0]) {
			fmt.Fprint(os.Stderr, usage)
			os.Exit(2)
		}
		component, args = args[0], args[1:]
	}
	os.Exit(run(component, args))
}

func known(name string) bool {
	switch name {
	case "etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl":
		return true
	}
	return false
}

func run(component string, args []string) int {
	// Upstream commands read os.Args themselves (cobra, etcd's flag set): give them theirs.
	os.Args = append([]string{component}, args...)
	switch component {
	case "etcd":
		etcdmain.Main(os.Args)
		return 0
	case "kube-apiserver":
		return cli.Run(apiserver.NewAPIServerCommand())
	case "kube-scheduler":
		return cli.Run(scheduler.NewSchedulerCommand())
	case "kube-controller-manager":
		return cli.Run(controllermanager.NewControllerManagerCommand())
	case "kubectl":
		command := kubectl.NewDefaultKubectlCommand()
		if err := cli.RunNoErrOutput(command); err != nil {
			fmt.Fprintln(os.Stderr, strings.TrimSpace(err.Error()))
			return 1
		}
		return 0
	}
	return 2
}
